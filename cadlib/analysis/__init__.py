"""Analysis (numpy, pandas, plotly; no torch): the step simulator, idle studies, summaries of the
committed runs, the claims of the papers against ours, the report and the plots."""
