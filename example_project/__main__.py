from example_project.demo import main

raise SystemExit(main())
