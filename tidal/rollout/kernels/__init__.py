"""Triton kernels of the engine (paged decode and context attention, exact-mode ops, fused MoE experts, fused
sampling), attention with sinks, and the wrapper of torch's varlen flash attention (``flash_varlen.py``).
Triton is optional: each module is imported only where a kernel runs."""
