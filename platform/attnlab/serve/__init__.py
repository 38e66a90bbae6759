"""``attnlab serve``: a read-only web page for watching studies (trials, live training curves, extrapolation
curves, the Table-4 layout, the best configuration, links to the Ray dashboard, TensorBoard and optuna-dashboard).

``data`` reads studies and results into plain dicts (testable without a server); ``app`` is the Starlette
application over it; ``cli`` the command. The page's JavaScript (Plotly's, from the ``plotly`` wheel, and its
own) is served by the application itself: nothing comes from a CDN. Never writes to a store or a runs folder,
never imports Ray.
"""
