"""Data (numpy; imports the core): document-length distributions, packing documents into the linear
layout, and the attention mask types."""
