"""The control plane: weights arrive (stream or path) -> staged -> validated -> committed on every engine."""
