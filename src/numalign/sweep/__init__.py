"""The day-0 sweep: a tiny random checkpoint of every causal-LM type the installed
transformers ships, captured, replayed honestly, planted with a wrong norm, and tabled."""
