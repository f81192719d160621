"""Triton kernels of the engine (paged decode and context attention, exact-mode ops, fused MoE experts, fused
sampling) and attention with sinks. Triton is optional: each module is imported only where a kernel runs."""
