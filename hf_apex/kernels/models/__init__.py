"""What changes a transformers model, per instance and reversibly: its norms rewired to apex's, its loss, RoPE computed
once, its attention's backend and masks."""
