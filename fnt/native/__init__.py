"""The native CPU AdamW kernel: its C++ source and the code that builds it on first use."""
