"""moetune's hybrid MoE inference engine (see README "The engine" and ../shared/DESIGN.md)."""

from engine.env import apply_huge_pages, apply_omp_wait_policy

apply_omp_wait_policy()  # before anything imports torch: libgomp reads it once, on load
apply_huge_pages()  # and PyTorch's allocator, at its first allocation
