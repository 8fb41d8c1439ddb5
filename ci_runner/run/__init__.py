"""Running a matrix: cells in child processes (execute), the modes inside a cell (cellrun), and merging results (aggregate)."""
