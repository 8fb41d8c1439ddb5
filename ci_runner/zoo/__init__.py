"""The transformers zoo as a model source: catalog, small configs, synthetic inputs, the scan, its report data."""
