"""``python -m robustrl.services.rollout``: one rollout replica process."""

from robustrl.services.rollout.replica import main

if __name__ == "__main__":
    main()
