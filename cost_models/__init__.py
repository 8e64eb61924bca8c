"""Cost models: pure functions of shapes and a frozen hardware spec. They import no pass."""
