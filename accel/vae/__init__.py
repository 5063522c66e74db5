"""Parallel VAE decode: the decoder's rows split over the ranks, equal to the single-process decode."""

from accel.vae.decode import ParallelDecode, plan_for

__all__ = ["ParallelDecode", "plan_for"]
