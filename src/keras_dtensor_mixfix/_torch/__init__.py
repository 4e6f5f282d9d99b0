"""The torch boundary: every private torch API the package uses, the supported torch range, and a self-check of both."""
