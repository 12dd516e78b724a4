"""The stage metrics: the callback (hooks only), step records, the FLOPs behind MFU, and the run summary."""
