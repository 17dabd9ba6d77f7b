"""device layer; see README "Layout"."""
