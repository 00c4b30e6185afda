"""``python -m robustrl.services.trainer``: one trainer gang worker (rank from the environment)."""

from robustrl.services.trainer.worker import main

if __name__ == "__main__":
    main()
