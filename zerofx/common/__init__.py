"""What every layer uses and that depends on nothing of zerofx: the error hierarchy, byte units,
resident-memory readings and the torch-free bounds the command line checks. The bottom layer."""
