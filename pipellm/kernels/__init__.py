"""Kernels of pipellm's own, where the libraries torch calls leave speed on the table."""
