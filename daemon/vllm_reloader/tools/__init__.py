"""Programs around the daemon: the producer side (`publish`) and the demo."""
