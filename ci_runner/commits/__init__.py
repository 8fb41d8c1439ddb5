"""`deepview-ci bisect-commits`: bisect a backend's own git history with a finding's verified repro."""
