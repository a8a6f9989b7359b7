"""Speculative decoding: proposers guess a few next tokens, the target model checks them all in
one forward (vgraph/spec/verify.py), and every accepted guess is a decode step saved."""
