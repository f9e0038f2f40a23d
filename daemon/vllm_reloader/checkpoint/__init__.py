"""What a checkpoint is and whether it may load: pure functions of files, no threads, no
network. `files` (standard library only) is shared with the engine-side extension."""
