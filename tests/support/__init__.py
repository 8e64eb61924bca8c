"""What the tests share: rank processes, models, and the functions ranks run. Not tests."""
