"""Speculative decoding: cheap proposers guess the next few tokens, and the
rejection sampler keeps the guesses the target model agrees with."""
