"""The alignment suites (operators/, models/). Options come from the numalign plugin."""
