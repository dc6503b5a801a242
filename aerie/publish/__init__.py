"""The run's published folders, one per drafter, with their model cards (rule model_card: the cards also as pages of
the HTML report), and the HTML report's figures (rule report_figures)."""
