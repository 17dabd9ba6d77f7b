"""device/model layer; see README "Layout"."""
