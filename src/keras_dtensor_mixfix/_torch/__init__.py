"""The torch boundary: every private torch API the package uses, and the supported torch range."""
