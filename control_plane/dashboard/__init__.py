"""The dashboard at `/dashboard`: server-rendered pages (Jinja2) with charts drawn by the vendored Chart.js
(static/, MIT, served from here: no page needs the internet). A tenant signs in with an API key and sees its
own spend by phase and region, savings against colocated, tokens, GB shipped, TTFT/TPOT percentiles and its
recent jobs with their placement; the admin key opens the fleet view (regions, queues, links, prices, spend
by tenant). Sessions and CSRF: sessions.py. Page data: data.py. Charts read their data from a JSON block in
the page (`<script type="application/json">`, so the Content-Security-Policy allows scripts from 'self' only).

routes.py: the pages and sign-in; data.py: what each page shows; sessions.py: sessions and CSRF;
templates/ and static/ (vendored Chart.js, MIT).
"""

from prfaas.control_plane.dashboard.routes import install

__all__ = ["install"]
