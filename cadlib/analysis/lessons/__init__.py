"""The notebooks' plumbing, so cells stay a few lines: hand-sized examples (``toys``, chapter 2's ``cad``),
each notebook's claims in one call (``claims``) and the exercises' checks (``exercises``)."""
