"""apex's kernels, bound: what is installed and can run (availability), the fused norms, the fused optimizers."""
