"""The reproduction report: recorded metrics (``metrics``), the papers' claims against ours (``claims``),
the scale replay's claims (``scale``), the evidence appendix, the headline block and the page (``writer``)."""
