"""Tenant limits, budgets and cost: exact across gateway instances sharing one Redis.

``limiter`` is the front (admit, then finish); ``gcra`` the rate algorithm; ``memory`` and
``redis_store`` (with ``lua``) the two stores behind one contract (``store``); ``cost`` the
price arithmetic; ``windows`` the budget windows; ``usage`` records, alerts and reports;
``estimate`` the token reservation; ``headers`` the ``x-ratelimit-*`` headers.
"""
