"""The what-if planner on a user's documents and cluster: its inputs (``setup``), the plan and its
error band (``planner``), and the terminal table, figures and HTML page a reader sees (``page``)."""
