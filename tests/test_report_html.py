"""The report's HTML pages: the leaderboard's Markdown rendered, a target's metrics as tables."""

from xmc_steps import report_html


def test_markdown_tables_headings_lists_and_escaping():
    md = "# debtags\n\nRanked by **P@1**; see `x`.\n\n| method | P@1 |\n|---|---:|\n| a \\| b | 1.00 |\n| <x> | 2 |\n\n* one\n* two\n"
    page = report_html.markdown_to_html(md, "t")
    assert "<h1>debtags</h1>" in page and "<b>P@1</b>" in page and "<code>x</code>" in page
    assert "<tr><th>method</th><th>P@1</th></tr>" in page and "<td>a | b</td><td>1.00</td>" in page
    assert "<td>&lt;x&gt;</td>" in page and "<ul><li>one</li><li>two</li></ul>" in page
    assert "javascript:" not in report_html.markdown_to_html("[a](javascript:alert(1))")


def test_metrics_page_has_the_grid_the_recall_the_deciles_the_costs_and_the_paper():
    result = {"dataset": "eurlex4k", "method": "parabel", "n_train_docs": 10, "n_test_docs": 5, "n_labels": 3,
              "metrics": {**{f"{m}_at_{k}": 10.0 * k for m in ("p", "ndcg", "psp", "psndcg") for k in (1, 3, 5)},
                          **{f"recall_at_{k}": 50.0 for k in (10, 20, 100)}, "decile_recall_at_100": [1.0] * 10},
              "total_train_time_s": 12.5, "predict_latency_ms_per_doc": 0.25, "model_size_bytes": 2_000_000,
              "device": "cpu", "reported": {"p_at_1": 82.12, "p_at_3": 68.91, "p_at_5": 57.89, "source": "Table 3"}}
    page = report_html.metrics_page(result)
    assert "<tr><td>PSP</td><td>10.00</td><td>30.00</td><td>50.00</td></tr>" in page
    assert "<tr><td>P (Table 3)</td><td>82.12</td><td>68.91</td><td>57.89</td></tr>" in page
    assert "<th>d10</th>" in page and "<td>model size (MB)</td><td>2.000</td>" in page
