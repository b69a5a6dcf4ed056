"""The native CPU AdamW kernel: its C++ source and the code that builds it on first use.
Side effects: the build's (fnt.native.build: compiles into a cache directory and imports the
result); this file holds no code."""
