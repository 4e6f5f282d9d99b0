"""The promotion engine: find the plain operands of a mixed call, promote them, run the op."""
