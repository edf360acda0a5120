"""Dataset loaders: real files with clear errors when missing, and labelled synthetic stand-ins."""
