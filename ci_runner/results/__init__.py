"""What a run produced and what it means: the result model (`model`), root causes (`rootcause`), the baseline diff (`baseline`)."""
