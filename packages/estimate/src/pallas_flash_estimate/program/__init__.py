"""A whole program estimated: every op its compiled schedule runs, charged once per run
(`program.whole_program`), and its collectives over the slice's interconnect
(`program.ici`)."""
