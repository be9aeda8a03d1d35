"""The monitor's evaluation through the real trainers: healthy runs and planted faults trained
by the Hugging Face ``Trainer`` and by Lightning, each with ``HealthCallback()`` at its defaults.

- ``sets.py``: the data sets (torch ``Dataset`` s of dicts) over the real data of
  ``evaluation/detectors/data.py`` (scikit-learn's tables and digits, the standard library's source,
  the interpreter's help texts): nothing is downloaded;
- ``hf.py``: the Hugging Face families (tiny GPT-2, Llama, BERT and a table classifier built
  from config; the Trainer's own optimizers and schedulers or the user's, gradient
  accumulation, bf16, label smoothing, a ``compute_loss_func``);
- ``lit.py``: the Lightning families (their own ``configure_optimizers``, accumulation,
  gradient clipping, bf16-mixed, manual optimization; classifiers, a regression, a causal
  transformer);
- ``faults.py``: the faults, planted as they happen in real runs (a wrapped collator, a
  callback of the harness's own, a loss override) at a known step, each with its delay and its
  expected cause;
- ``runner.py``: one run (train, read the monitor and its ``steps.jsonl``, score it, and for a
  fault how far it moved the loss: ``effect_z``) and the check that the callback leaves the
  trainer's own logs alone;
- ``corpus.py``: which families are tuned on and which are held out (each family's
  ``held_out``: the five held out until the first held-out scoring are tuning families since,
  and five newer ones are held out), and the jobs;
- ``figure.py``: one row per run, the fault's step, the alarms coloured by kind.

``evaluation/eval_trainers.py`` runs them (its docstring says how); the scores so far are in
docs/performance.md ("Through the real trainers") and bench/results/trainers.json.
"""
