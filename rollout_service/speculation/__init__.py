"""Speculative decoding: configuration, the CPU sampling fix, the losslessness check, drafter preparation."""
