"""What a run's results look like to a reader: the Markdown report (`report`, `compiled_report`,
`comparison`, `model_report`, `context_report`, `calibration_report`, `stacks_report`, on the
cells of `cells`), the roofline plot (`roofline`) and the README's generated blocks (`readme`).
Views only format what ``results.json`` holds."""
