"""C++ and CUDA sources of fastdet.ops, shipped as package data and built on first use."""
