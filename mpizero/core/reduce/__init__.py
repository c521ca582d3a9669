"""Exact, order-free gradient sums: int64 fixed point (``exact``), its scale per tensor and step (``scales``),
what each rank hands in (``tally``), the host and device kernels (``kernels``, ``arithmetic``), and the global norm."""
