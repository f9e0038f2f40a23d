"""The daemon process: one loop that acts (`daemon`), fed by typed messages (`messages`)."""
