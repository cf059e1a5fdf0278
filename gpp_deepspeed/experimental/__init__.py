"""What is not supported yet: code that core never imports or branches on (style guide, rule 15).

``virtual``: folds of a stage DAG onto fewer ranks (several stages per rank) and a greedy compute
order for each rank, priced by the pure compute makespan; the engine does not run folded programs.
"""

__all__: list[str] = []
