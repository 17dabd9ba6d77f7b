"""io layer; see README "Layout"."""
