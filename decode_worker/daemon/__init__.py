"""daemon layer; see README "Layout"."""
