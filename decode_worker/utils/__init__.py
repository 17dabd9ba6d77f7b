"""utils layer; see README "Layout"."""
