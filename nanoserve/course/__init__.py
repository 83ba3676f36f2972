"""The course's own tooling, kept apart from the engine: `import nanoserve` never loads it.

    from nanoserve.course import grading      # PASS/FAIL checks inside a lab
    python -m nanoserve.course.grade NB       # grade a learner's lab notebook
    from nanoserve.course.notebook import show  # show engine source in a chapter
    from nanoserve.course import dataset      # lab 03's corpus, store and scores
    python -m nanoserve bench                 # offline benchmark (nanoserve.course.bench)
    from nanoserve.course import evals, lmeval  # the shipped lm-eval tasks; lm-eval run against a server
"""
